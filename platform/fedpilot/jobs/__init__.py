"""Jobs: the queue of submitted runs and searches with its workers (queue), Slurm (slurm, slurm_options), the
Backend each job runs on (backend: the queue or Slurm), cron schedules that queue searches (schedule) and the
result file a job's process leaves for its worker (result_file). Their database tables are in fedpilot.db; their
commands are in fedpilot.cli.jobs."""
