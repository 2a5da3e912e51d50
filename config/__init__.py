"""Config files of skyrl-megatron (Hydra). Installed as the package `skyrl_megatron.conf`."""
