"""``python -m vllm_tokenswift.cli``: the ``vllm-tokenswift`` command."""

import sys

from vllm_tokenswift.cli import main

if __name__ == "__main__":
    sys.exit(main())
