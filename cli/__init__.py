"""The `dspark` command: parses flags and composes the packages below it."""
