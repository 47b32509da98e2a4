"""`deepspeed` as an alias of dsrun: `import deepspeed` gives the dsrun
module and `deepspeed.X` gives `dsrun.X` (see dsrun/compat/alias.py)."""
from dsrun.compat.alias import install

install()  # replaces this module in sys.modules by dsrun
