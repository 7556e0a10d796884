"""The packaged Hydra config (a package, so Hydra finds it by module name wherever batchjob is installed)."""
