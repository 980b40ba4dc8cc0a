"""Tools built on the runtime that training does not use: the rehearsal of a plan (rehearsal.py)."""
