"""The built-in lab: N simulated DGX Spark hosts on one Linux machine (see manage.py)."""
