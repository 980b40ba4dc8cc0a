"""The `zb-schedule` command line: the planning commands (planning.py, options.py), `rehearse` (rehearse.py) and
`advise` (megatron/zero_bubble/advise/cli.py). The command line sits above the torch-free planning layer
(schedules/), which holds no argparse.
"""
