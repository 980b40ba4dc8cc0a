"""`zb-schedule advise`: which pipeline schedule for a pretrain_gpt.py command line, and its memory per GPU.

Above the planning layer (schedules/), beside the command line: command_line.py reads megatron's flags with
megatron's parser (the only module that imports megatron and torch), run.py holds what it read, parameters.py and
activations.py count bytes, stage_costs.py makes the planner's costs, candidates.py lists the schedules as training
runs them, advice.py plans and predicts, report.py and cli.py print. See docs/advise.md.
"""
