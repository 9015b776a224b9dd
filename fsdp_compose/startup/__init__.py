"""What runs as every Python process of a launched program starts: python -m fsdp_compose.run
puts this folder on PYTHONPATH (sitecustomize.py)."""
