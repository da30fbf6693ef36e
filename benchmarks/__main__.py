"""``python -m benchmarks``: see benchmarks/run.py."""

from benchmarks.run import main

if __name__ == "__main__":
    main()
