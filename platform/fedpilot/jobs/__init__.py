"""Jobs: the queue of submitted runs and searches with its workers (queue), cron schedules that queue searches
(schedule), the result file a job's process leaves for its worker (result_file), and their commands (cli). Their
database tables are in fedpilot.db."""
