"""DeepSpeed compatibility plumbing: the names dsrun does not have yet
(missing.py) and the `deepspeed` import name (alias.py).

Nothing here imports torch; `import dsrun` installs the finder of
missing.py so that importing a DeepSpeed module dsrun lacks says so.
"""
