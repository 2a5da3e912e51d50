"""The exit statuses of the `skyrl-megatron` command and the demo (documented in docs/architecture.md)."""

OK = 0
FAILED = 1  # training failed: the error names the worker, engine or hang
CONFIG_ERROR = 2  # the config was refused before anything started
# stopped on the preemption signal after writing a checkpoint; rerunning the same command resumes from it
# (75 is EX_TEMPFAIL: a temporary failure, try again)
PREEMPTED = 75
