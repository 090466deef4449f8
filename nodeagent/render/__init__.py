"""Config to the exact commands and environments the guide prescribes (`LaunchSpec`): pure, golden-tested.
"""
