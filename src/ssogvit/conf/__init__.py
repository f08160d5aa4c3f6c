"""Hydra configuration files of ssogvit (package data): config.yaml, data/, model/, experiment/."""
