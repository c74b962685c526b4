"""``dsplug elastic -c CONFIG [-w WORLD_SIZE]``: the elastic batch size of a config (DeepSpeed's
``ds_elastic``; the deepspeed alias installs it under that name).

Prints the ``elasticity`` section, then the batch size every valid world size trains with and
those world sizes; with ``-w`` also the micro-batch size at that world size. A bad config or a
world size the batch does not fit is one line on stderr and exit 1.
"""
from __future__ import annotations

import json
import sys

from dsplug.descriptors import CliCommand

HELP = "the elastic batch size and valid world sizes of a config's elasticity section (ds_elastic)"


def add_arguments(p) -> None:
    p.add_argument("-c", "--config", required=True, help="DeepSpeed-format config (JSON or HJSON)")
    p.add_argument("-w", "--world-size", type=int, default=0,
                   help="the intended / current world size: also print its micro-batch size (0: not given)")


def run(args) -> int:
    import dsplug
    from dsplug.config.loader import load_raw
    from dsplug.config.schema import ConfigError

    from . import constants as C
    from .config import ElasticityError
    from .elasticity import compute_elastic_config

    try:
        raw, _ = load_raw(args.config)
        section = raw.get(C.ELASTICITY)
        results = compute_elastic_config(raw, target_deepspeed_version=dsplug.__version__, world_size=args.world_size)
    except (ConfigError, ElasticityError, OSError) as exc:
        print(f"dsplug elastic: {args.config}: {exc}", file=sys.stderr)
        return 1
    rule = "-" * 42
    print(f"{rule}\nElasticity config:\n{rule}\n{json.dumps(section, indent=4, sort_keys=True)}")
    heading = f"for world size {args.world_size}" if args.world_size else ""
    print(f"{rule}\nCalculated results{' ' + heading if heading else ''}:\n{rule}")
    print(f"final_batch_size .... {results[0]}")
    print(f"valid_gpus .......... {results[1]}")
    if args.world_size:
        print(f"micro_batch_size .... {results[2]}")
    return 0


ELASTIC = CliCommand(name="elastic", help=HELP, description=__doc__.split("\n\n")[0], add_arguments=add_arguments,
                     run=run)
