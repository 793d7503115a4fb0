"""The `dspark-pd` command line."""
