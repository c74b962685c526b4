"""DeepSpeed's ``deepspeed.elasticity.constants``: the ``elasticity`` section's keys and defaults.

The names are DeepSpeed's (``MAX_ACCEPTABLE_BATCH_SIZE`` is the key ``max_train_batch_size``);
the defaults are the ones DeepSpeed documents for the section.
"""

ELASTICITY = "elasticity"

#: the newest version of the elastic batch logic (0.1: GPU counts; 0.2: whole nodes, model parallel)
LATEST_ELASTICITY_VERSION = 0.2
#: the first DeepSpeed release that had elastic training
MINIMUM_DEEPSPEED_VERSION = "0.3.8"

#: environment variable a resource scheduler sets to the ``elasticity`` section it planned with
DEEPSPEED_ELASTICITY_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"

ENABLED = "enabled"
ENABLED_DEFAULT = False

MAX_ACCEPTABLE_BATCH_SIZE = "max_train_batch_size"
MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT = 2000

MICRO_BATCHES = "micro_batch_sizes"
MICRO_BATCHES_DEFAULT = [2, 4, 6]

MIN_GPUS = "min_gpus"
MIN_GPUS_DEFAULT = 1

MAX_GPUS = "max_gpus"
MAX_GPUS_DEFAULT = 10000

NUM_GPUS_PER_NODE = "num_gpus_per_node"
NUM_GPUS_PER_NODE_DEFAULT = 1

MODEL_PARALLEL_SIZE = "model_parallel_size"
MODEL_PARALLEL_SIZE_DEFAULT = 1

MIN_TIME = "min_time"
MIN_TIME_DEFAULT = 0

PREFER_LARGER_BATCH = "prefer_larger_batch"
PREFER_LARGER_BATCH_DEFAULT = True

IGNORE_NON_ELASTIC_BATCH_INFO = "ignore_non_elastic_batch_info"
IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT = False

VERSION = "version"
VERSION_DEFAULT = LATEST_ELASTICITY_VERSION
