from tokenmill.entrypoints.cli import main

raise SystemExit(main())
