"""Sweeps: a grid of config overrides run as sub-workdirs (spec, runner), aggregated into tables
with bootstrap intervals and plots."""
