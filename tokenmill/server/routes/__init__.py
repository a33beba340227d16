"""The HTTP routes, one module per API; each ``register``s its routes on the app
(app.py calls them in order). A route parses its body, builds the job that answers it
(jobs/job.py, jobs/response_job.py) and hands it to the gateway or answers with it.
"""
