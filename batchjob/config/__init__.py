"""Configuration: the Hydra config checked and turned into frozen settings (`settings.py`), which keys exist
(`keys.py`, so a typo is refused with the closest key) and `--help` (`help.py`, the packaged config files'
comments). Every user mistake found here is a `ConfigError`, exit status 2, before any model loads."""
