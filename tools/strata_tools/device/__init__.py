"""The device tools behind the commands in tools/device/."""
