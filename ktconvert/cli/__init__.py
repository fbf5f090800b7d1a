"""The command line: one click group (main.py), its shared options, and the output of plan/inspect."""
