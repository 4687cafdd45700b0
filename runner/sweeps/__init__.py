"""A sweep's core, in one room: its jobs and what the launchers share (launched, slots, job,
job_dirs), resuming a sweep in its directory (resume), its progress line and tables
(progress, tables), hydra/sweeper=runner's Optuna study (study_sweep, search_space, study,
and study_server, which a job's rank 0 reports to), and hydra/launcher=tune (tune_sweep,
tune_trial, ray_cluster). The plugins under hydra_plugins/ are thin shims over it; cli/
keeps the commands."""
