"""Hosts: reaching and preparing them (remote access, the run account, code sources), their checks and their agents."""
