"""The stand-in's Inductor: a package holding only its configuration (config.py)."""
