"""`dsrun --autotuning tune|run`: find the fastest setting of ZeRO, batch and offload that fits.

The pieces, each with one job (docs/autotuning.md tells the whole story):

    space.py    the candidate settings a config's `autotuning` section asks for
    prune.py    the memory model: which candidates cannot fit (estimate_zero_memory)
    search.py   the order of the trials (gridsearch, random, model_based) and when to stop
    trial.py    one trial: a real dsrun launch of the script with the candidate's config
    results.py  what a trial measured (the engine's result file) or why it failed
    report.py   the live table, results_dir/summary and ds_config_optimal.json
    tuner.py    the loop that ties them together (`autotune`)

The launcher imports this package only for `--autotuning`; it imports torch
(through the config schema and the memory estimator), which a plain launch
does not.
"""
