import sys

from rampserve.serving.executor.core import main

main(sys.argv[1:])
