"""Layer 6, the command line: `main.py` builds one parser that registers each job's subcommand
and dispatches to it; `run_command.py` (`zerotrain run`) and `config_check.py` (`zerotrain config
check`) are its own small commands. Nothing below imports this package."""
