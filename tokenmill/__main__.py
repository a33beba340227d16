from tokenmill.cli import main

raise SystemExit(main())
