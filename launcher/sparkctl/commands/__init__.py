"""One module per command (or family of commands); each exposes `command` or `COMMANDS`."""
