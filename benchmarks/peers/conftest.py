# The peer comparison runs in its own virtualenvs (setup.sh), never under
# pytest: nothing here is collected.
collect_ignore_glob = ['*.py']
