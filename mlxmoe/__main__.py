import sys

try:
    from .cli import run
except KeyboardInterrupt:  # Ctrl-C while Python starts: no traceback
    sys.exit(130)

run()
