"""Bad input of every kind, to every subcommand: exit code 2, exactly one line on stderr that names
what is wrong and the fix, no traceback, nothing started and nothing written.

Every case runs in this process (conftest's `dtlab()`: no process group is needed to refuse an
input) from a workspace holding earlier results and the bad files; after each case the workspace
must be byte-for-byte as before and no process started by the case may be left.

CASES is the table of cases: (what the case shows, as a sentence; the command line after `dtlab`;
text the one line on stderr must contain). `{configs}` is the shipped configs/ directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path

import numpy as np
import pytest
from conftest import CONFIGS, cli, dtlab

CASES = [
    # ------------------------------------------------------------------ the command line itself
    ("dtlab without a command names what is missing", "",
     "the following arguments are required: COMMAND"),
    ("an unknown command is refused", "trian", "invalid choice: 'trian'"),
    ("an unknown option of train is refused", "train --gpus 2", "unrecognized arguments: --gpus"),
    ("resume=yes (a yes/no to YAML) names the words resume takes", "train resume=yes",
     "resume is given as a yes/no (yes, no, true or false), but it takes auto (the latest "
     "checkpoint in run.dir), none (start over) or a checkpoint's path; fix: resume=auto, "
     "resume=none or resume=PATH"),
    # ------------------------------------------------------------------ train: launch options
    ("train refuses zero ranks per node", "train --nproc-per-node 0",
     "argument --nproc-per-node: '0' must be at least 1"),
    ("train refuses a negative rank count", "train --nproc-per-node -2",
     "argument --nproc-per-node: '-2' must be at least 1"),
    ("train refuses nan ranks per node", "train --nproc-per-node nan",
     "argument --nproc-per-node: 'nan' is not a whole number"),
    ("train refuses a fractional rank count", "train --nproc-per-node 1.5",
     "argument --nproc-per-node: '1.5' is not a whole number"),
    ("train refuses a rank count in words", "train --nproc-per-node two",
     "argument --nproc-per-node: 'two' is not a whole number"),
    ("train refuses zero nodes", "train --nnodes 0", "argument --nnodes: '0' must be at least 1"),
    ("train on two nodes needs a rendezvous endpoint", "train --nnodes 2",
     "--nnodes > 1 needs --rdzv-endpoint"),
    ("train on two nodes refuses port 0", "train --nnodes 2 --rdzv-endpoint node1:0",
     "--rdzv-endpoint node1:0: port 0 cannot be shared"),
    ("train refuses negative restarts", "train --nproc-per-node 2 --max-restarts -1",
     "argument --max-restarts: '-1' must be at least 0"),
    ("train refuses infinite restarts", "train --nproc-per-node 2 --max-restarts inf",
     "argument --max-restarts: 'inf' is not a whole number"),
    ("train refuses restarts of a 1-rank run", "train --max-restarts 2",
     "--max-restarts applies to runs of 2 ranks or more"),
    ("train refuses an endpoint without a port", "train --nproc-per-node 2 --rdzv-endpoint foo",
     "argument --rdzv-endpoint: 'foo' is not HOST:PORT"),
    ("train refuses an endpoint port above 65535",
     "train --nproc-per-node 2 --rdzv-endpoint foo:99999", "port '99999' of 'foo:99999'"),
    ("train refuses an endpoint without a host", "train --nproc-per-node 2 --rdzv-endpoint :29400",
     "argument --rdzv-endpoint: ':29400' is not HOST:PORT"),
    ("train refuses an endpoint port that is not a number",
     "train --nproc-per-node 2 --rdzv-endpoint foo:http", "port 'http' of 'foo:http'"),
    ("train refuses an IPv6 endpoint without brackets",
     "train --nproc-per-node 2 --rdzv-endpoint ::1:29400", "an IPv6 host needs brackets"),
    ("train refuses an endpoint for a 1-rank run", "train --rdzv-endpoint localhost:29400",
     "--rdzv-endpoint applies to runs of 2 ranks or more"),
    ("train refuses rendezvous settings that are not key=value",
     "train --nproc-per-node 2 --rdzv-conf is_host", "'is_host' in 'is_host' is not key=value"),
    ("train refuses rendezvous settings for a 1-rank run", "train --rdzv-conf is_host=true",
     "--rdzv-conf applies to runs of 2 ranks or more"),
    ("train refuses a rendezvous id for a 1-rank run", "train --rdzv-id job42",
     "--rdzv-id applies to runs of 2 ranks or more"),
    ("train refuses an empty rendezvous id", "train --nproc-per-node 2 --rdzv-id ''",
     "argument --rdzv-id: is empty"),
    # ------------------------------------------------------------------ train: overrides
    ("an override without = is refused", "train seed", "override 'seed' must look like key=value"),
    ("an override without a key is refused", "train =0.1", "override '=0.1' must look like"),
    ("an override with an empty key part is refused", "train train..lr=1",
     "override 'train..lr=1' must look like"),
    ("an override below a value is refused", "train seed=1 seed.x=2",
     "override 'seed.x=2': 'seed' is a value, not a section"),
    ("a nan learning rate is refused", "train train.lr=nan", "train.lr: Input should be"),
    ("an infinite learning rate is refused", "train train.lr=.inf",
     "train.lr: Input should be a finite number"),
    ("a negative learning rate is refused", "train train.lr=-0.1",
     "train.lr: Input should be greater than 0"),
    ("a learning rate in words is refused", "train train.lr=fast",
     "train.lr: Input should be a valid number"),
    ("a zero global batch is refused", "train train.global_batch_size=0",
     "train.global_batch_size: Input should be greater than 0"),
    ("a negative global batch is refused", "train train.global_batch_size=-8",
     "train.global_batch_size: Input should be greater than 0"),
    ("zero epochs are refused", "train train.epochs=0", "train.epochs: Input should be greater"),
    ("negative max steps are refused", "train train.max_steps=-1",
     "train.max_steps: Input should be greater than or equal to 0"),
    ("fractional max steps are refused", "train train.max_steps=2.5",
     "train.max_steps: Input should be a valid integer"),
    ("momentum 1 is refused", "train train.momentum=1.0", "train.momentum: Input should be less"),
    ("one beta instead of two is refused", "train train.betas=[0.9]", "train.betas"),
    ("a negative gradient clip is refused", "train train.grad_clip=-1", "train.grad_clip"),
    ("an infinite weight decay is refused", "train train.weight_decay=.inf",
     "train.weight_decay: Input should be a finite number"),
    ("an unknown precision is refused", "train train.precision=fp8", "train.precision"),
    ("an unknown optimizer is refused", "train train.optimizer=lion", "train.optimizer"),
    ("an unknown schedule is refused", "train train.schedule=linear", "train.schedule"),
    ("keeping zero checkpoints is refused", "train train.keep_checkpoints=0",
     "train.keep_checkpoints"),
    ("an unknown nan policy is refused", "train train.nan_policy=ignore", "train.nan_policy"),
    ("a minimum lr ratio above 1 is refused", "train train.min_lr_ratio=2", "train.min_lr_ratio"),
    ("nesterov with adamw is refused", "train train.nesterov=true train.optimizer=adamw",
     "train.nesterov needs train.optimizer=sgd"),
    ("a GPT width that heads do not divide is refused",
     "train model.name=gpt model.n_embd=130 model.n_head=4", "model.n_embd=130 is not divisible"),
    ("a GPT dropout of 1 is refused", "train model.name=gpt model.dropout=1.0", "model.dropout"),
    ("a ResNet depth other than 18 or 34 is refused", "train model.name=resnet model.depth=50",
     "model.depth: Input should be 18 or 34"),
    ("a ResNet width of 0 is refused", "train model.name=resnet model.width=0", "model.width"),
    ("a negative CNN channel count is refused", "train model.channels=[16,-1]", "model.channels"),
    ("an unknown model is refused", "train model.name=vit", "model.name"),
    ("a GPT option on the CNN names its model", "train model.name=cnn model.n_layer=2",
     "config key 'model.n_layer' belongs to model.name=gpt, not model.name=cnn"),
    ("a misspelt GPT option gets a suggestion", "train model.name=gpt model.n_lyer=2",
     "unknown config key 'model.n_lyer'; fix: remove it (did you mean 'model.n_layer'?)"),
    ("a CNN option over a GPT config names its model",
     "train --config {configs}/fsdp_gpt.yaml model.channels=[8]",
     "config key 'model.channels' belongs to model.name=cnn, not model.name=gpt"),
    ("a ResNet option on the default CNN names its model", "train model.depth=18",
     "config key 'model.depth' belongs to model.name=resnet"),
    ("switching a GPT config to the CNN keeps no GPT option it was not given",
     "train --config {configs}/fsdp_gpt.yaml model.name=cnn model.n_head=2",
     "config key 'model.n_head' belongs to model.name=gpt, not model.name=cnn"),
    ("an unknown data set is refused", "train data.name=imagenet", "data.name"),
    ("token data for the CNN is refused", "train data.name=tokens",
     "model.name=cnn cannot train on data.name=tokens"),
    ("image data for the GPT is refused", "train model.name=gpt data.name=mnist",
     "model.name=gpt cannot train on data.name=mnist"),
    ("a single class is refused", "train data.synthetic.num_classes=1",
     "data.synthetic.num_classes"),
    ("nan noise is refused", "train data.synthetic.noise=.nan",
     "data.synthetic.noise: Input should be a finite number"),
    ("a negative train limit is refused", "train data.train_limit=-1", "data.train_limit"),
    ("logging every 0 steps is refused", "train run.log_every=0", "run.log_every"),
    ("a zero process-group timeout is refused", "train run.timeout_s=0", "run.timeout_s"),
    ("an infinite process-group timeout is refused", "train run.timeout_s=.inf",
     "run.timeout_s: Input should be a finite number"),
    ("an unknown device is refused", "train run.device=tpu", "run.device"),
    ("an unknown backend is refused", "train run.backend=mpi", "run.backend"),
    ("a one-step breakdown is refused", "train run.breakdown_steps=1", "run.breakdown_steps"),
    ("an unknown fault kind is refused", "train run.fault.kind=segfault", "run.fault.kind"),
    ("an unknown strategy is refused", "train strategy.name=zero9", "strategy.name"),
    ("a negative DDP bucket is refused", "train strategy.name=ddp strategy.ddp.bucket_cap_mb=-1",
     "strategy.ddp.bucket_cap_mb"),
    ("an unknown FSDP1 sharding is refused", "train strategy.fsdp1.sharding_strategy=HALF",
     "strategy.fsdp1.sharding_strategy"),
    ("a misspelt lab switch gets a suggestion", "train lab.no_zero_gradz=true",
     "did you mean 'lab.no_zero_grad'?"),
    ("a seed in words is refused", "train seed=abc", "seed: Input should be a valid integer"),
    ("an unknown section is refused", "train trainer.lr=0.1", "unknown config key 'trainer'"),
    ("a section given a value is refused", "train train=5", "train: Input should be"),
    ("a batch that two ranks cannot split is refused",
     "train --nproc-per-node 2 strategy.name=ddp train.global_batch_size=3",
     "train.global_batch_size=3 must be a positive multiple of world_size(2)"),
    ("single on two ranks is refused", "train --nproc-per-node 2",
     "strategy.name=single runs one process"),
    ("tensor parallelism of the CNN is refused", "train strategy.name=tp",
     "strategy.name=tp splits the layers of a GPT or a Llama-family Hugging Face model"),
    # ------------------------------------------------------------------ config files
    ("a binary config file is refused", "train --config bad/binary.yaml",
     "config file 'bad/binary.yaml' is not UTF-8 text"),
    ("a UTF-16 config file is refused", "train --config bad/utf16.yaml",
     "config file 'bad/utf16.yaml' is not UTF-8 text"),
    ("a Latin-1 config file is refused", "train --config bad/latin1.yaml",
     "config file 'bad/latin1.yaml' is not UTF-8 text"),
    ("an empty config file is refused, saying how to get the defaults",
     "train --config bad/empty.yaml", "config file 'bad/empty.yaml' is empty"),
    ("a config file of comments only is refused", "train --config bad/comments.yaml",
     "config file 'bad/comments.yaml' is empty (or only comments)"),
    ("a config file holding a list is refused", "train --config bad/list.yaml",
     "config file 'bad/list.yaml' must hold a mapping of sections"),
    ("a config file holding one word is refused", "train --config bad/scalar.yaml",
     "config file 'bad/scalar.yaml' must hold a mapping of sections"),
    ("a config file with an unclosed bracket is refused", "train --config bad/bracket.yaml",
     "config file 'bad/bracket.yaml' is not valid YAML at line 3"),
    ("a config file indented with a tab is refused", "train --config bad/tab.yaml",
     "config file 'bad/tab.yaml' is not valid YAML"),
    ("a config file of two documents is refused", "train --config bad/two_docs.yaml",
     "config file 'bad/two_docs.yaml' is not valid YAML at line 2 (but found another document)"),
    ("a config file with a python object tag is refused", "train --config bad/python_tag.yaml",
     "config file 'bad/python_tag.yaml' is not valid YAML at line 1 (could not determine a "
     "constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system')"),
    ("a directory given as the config file is refused", "train --config bad",
     "config file 'bad' is a directory"),
    ("a missing config file is refused", "train --config bad/absent.yaml",
     "config file 'bad/absent.yaml' not found"),
    ("a config file that fails to read is refused", "train --config /proc/self/mem",
     "config file '/proc/self/mem' cannot be read (Input/output error)"),
    ("a config file without read permission is refused", "train --config bad/unreadable.yaml",
     "config file 'bad/unreadable.yaml' cannot be read (Permission denied)"),
    ("a config file with a number as a section name is refused", "train --config bad/int_key.yaml",
     "config file 'bad/int_key.yaml': key 1 is not a name"),
    ("a config file with a list as a section is refused", "train --config bad/list_section.yaml",
     "train: Input should be"),
    ("a config file with an unknown section is refused", "train --config bad/unknown_section.yaml",
     "unknown config key 'trainer'"),
    ("a config file with a misspelt key is refused", "train --config bad/misspelt.yaml",
     "unknown config key 'train.lrr'; fix: remove it (did you mean 'train.lr'?)"),
    ("a config file with a bad value is refused", "train --config bad/bad_value.yaml",
     "train.lr: Input should be greater than 0"),
    ("a config file with the model as one word is refused", "train --config bad/model_word.yaml",
     "model: Input should be"),
    # ------------------------------------------------------------------ config
    ("config --keys takes no config file", "config --keys --config {configs}/quick.yaml",
     "--keys lists the keys of every config"),
    ("config --keys takes no overrides", "config --keys train.lr=1",
     "--keys lists the keys of every config"),
    ("config refuses a binary file", "config --config bad/binary.yaml",
     "config file 'bad/binary.yaml' is not UTF-8 text"),
    ("config refuses a directory", "config --config bad/tokens_empty",
     "config file 'bad/tokens_empty' is a directory"),
    ("config refuses a progress setting in words", "config run.progress=sometimes",
     "run.progress"),
    ("a DeepSpeed config holding a list is refused",
     "train strategy.name=deepspeed strategy.deepspeed.config=bad/ds_list.json",
     "'bad/ds_list.json' holds a JSON list, not an object"),
    # ------------------------------------------------------------------ token data sets
    ("an empty token file is refused", "train {gpt} data.dir=bad/tokens_empty",
     "bad/tokens_empty/train.bin is empty"),
    ("a token file of an odd byte count is refused", "train {gpt} data.dir=bad/tokens_odd",
     "bad/tokens_odd/train.bin is not a whole number of uint16 tokens (3 bytes)"),
    ("a uint32 token file of 6 bytes is refused", "train {gpt} data.dir=bad/tokens_uint32_6",
     "bad/tokens_uint32_6/train.bin is not a whole number of uint32 tokens (6 bytes)"),
    ("a token dtype other than uint16/uint32 is refused",
     "train {gpt} data.dir=bad/tokens_meta_int8",
     "bad/tokens_meta_int8/meta.json is not a JSON object with a positive whole vocab_size and a "
     "dtype of uint16 or uint32"),
    ("a token directory without train.bin is refused", "train {gpt} data.dir=bad/no_tokens",
     "token file bad/no_tokens/train.bin not found"),
    ("a missing token directory is refused", "train {gpt} data.dir=bad/absent_dir",
     "token file bad/absent_dir/train.bin not found"),
    ("a token set without val.bin is refused", "train {gpt} data.dir=bad/tokens_no_val",
     "token file bad/tokens_no_val/val.bin not found"),
    ("a token meta.json that is not JSON is refused", "train {gpt} data.dir=bad/tokens_meta_text",
     "bad/tokens_meta_text/meta.json is not a JSON object"),
    ("a token meta.json holding a list is refused", "train {gpt} data.dir=bad/tokens_meta_list",
     "bad/tokens_meta_list/meta.json is not a JSON object"),
    ("a negative vocabulary in meta.json is refused",
     "train {gpt} data.dir=bad/tokens_meta_negative",
     "bad/tokens_meta_negative/meta.json is not a JSON object with a positive whole vocab_size"),
    ("a token file shorter than one sequence is refused", "train {gpt} data.dir=bad/tokens_short",
     "bad/tokens_short/train.bin holds 10 tokens, fewer than one sequence of 65"),
    ("token ids above the vocabulary are refused", "train {gpt} data.dir=bad/tokens_big_ids",
     "bad/tokens_big_ids/train.bin uses token ids up to 299 but model.vocab_size=256"),
    ("an empty token file is refused once for two ranks",
     "train --nproc-per-node 2 {gpt} strategy.name=ddp data.dir=bad/tokens_empty",
     "bad/tokens_empty/train.bin is empty"),
    ("a damaged meta.json is refused once for two ranks",
     "train --nproc-per-node 2 {gpt} strategy.name=ddp data.dir=bad/tokens_meta_text",
     "bad/tokens_meta_text/meta.json is not a JSON object"),
    # ------------------------------------------------------------------ compare
    ("compare refuses a strategy list of commas", "compare --strategies ,",
     "--strategies ',' names no strategy"),
    ("compare refuses an empty strategy list", "compare --strategies ''",
     "--strategies '' names no strategy"),
    ("compare refuses an empty entry in the strategy list", "compare --strategies ddp,,fsdp",
     "--strategies 'ddp,,fsdp' has an empty entry"),
    ("compare refuses a strategy listed twice", "compare --strategies ddp,fsdp,ddp",
     "--strategies 'ddp,fsdp,ddp' has 'ddp' twice"),
    ("compare refuses an unknown strategy", "compare --strategies ddp,zero9",
     "--strategies: unknown strategy 'zero9'"),
    ("compare refuses an unknown FSDP1 variant", "compare --strategies fsdp1:HALF_SHARD",
     "--strategies: 'fsdp1:HALF_SHARD' is not valid"),
    ("compare refuses a mesh for a data-parallel strategy", "compare --strategies ddp@2",
     "--strategies: 'ddp@2': only"),
    ("compare checks a model-parallel strategy against the model before any run",
     "compare --strategies single,ddp,tp", "--strategies tp on 2 rank(s): strategy.name=tp"),
    ("compare checks the pipeline against the model before any run",
     "compare --strategies single,pp", "--strategies pp on 2 rank(s): strategy.name=pp"),
    ("compare checks the batch against each strategy's ranks before any run",
     "compare --strategies single,ddp --nproc-per-node 3",
     "--strategies ddp on 3 rank(s): train.global_batch_size=64 must be a positive multiple"),
    ("compare refuses a negative tolerance", "compare --verify --tolerance -1",
     "argument --tolerance: '-1' must be at least 0"),
    ("compare refuses a nan tolerance", "compare --verify --tolerance nan",
     "argument --tolerance: 'nan' is not a finite number"),
    ("compare refuses an infinite tolerance", "compare --verify --tolerance inf",
     "argument --tolerance: 'inf' is not a finite number"),
    ("compare refuses a tolerance without --verify", "compare --tolerance 0.1",
     "--tolerance applies to --verify"),
    ("compare refuses zero ranks per node", "compare --nproc-per-node 0",
     "argument --nproc-per-node: '0' must be at least 1"),
    ("compare refuses a binary config file", "compare --config bad/binary.yaml",
     "config file 'bad/binary.yaml' is not UTF-8 text"),
    ("compare refuses a missing config file", "compare --config bad/absent.yaml",
     "config file 'bad/absent.yaml' not found"),
    ("compare refuses a bad override before any run", "compare train.lr=-1",
     "train.lr: Input should be greater than 0"),
    ("compare refuses an output directory that is a file", "compare --out earlier/results.csv",
     "--out 'earlier/results.csv': 'earlier/results.csv' is a file"),
    ("compare refuses a run directory of its own choosing", "compare run.dir=mine",
     "run.dir is chosen by compare"),
    ("compare refuses a model and data that do not go together",
     "compare --strategies ddp model.name=gpt data.name=cifar10",
     "model.name=gpt cannot train on data.name=cifar10"),
    # ------------------------------------------------------------------ sweep
    ("sweep refuses a missing spec", "sweep bad/absent.yaml",
     "sweep spec 'bad/absent.yaml' not found"),
    ("sweep refuses a directory as the spec", "sweep bad", "sweep spec 'bad' is a directory"),
    ("sweep refuses a binary spec", "sweep bad/binary.yaml",
     "sweep spec 'bad/binary.yaml' is not UTF-8 text"),
    ("sweep refuses an empty spec", "sweep bad/empty.yaml", "sweep spec 'bad/empty.yaml' is empty"),
    ("sweep refuses a spec holding a list", "sweep bad/list.yaml",
     "sweep spec 'bad/list.yaml' must hold a mapping"),
    ("sweep refuses a spec that is not YAML", "sweep bad/bracket.yaml",
     "sweep spec 'bad/bracket.yaml' is not valid YAML"),
    ("sweep refuses an unknown spec key", "sweep sweeps/matrics.yaml",
     "unknown config key 'matrics'"),
    ("sweep refuses zero ranks per node in the matrix", "sweep sweeps/nproc_zero.yaml",
     "matrix value nproc_per_node=0: must be a whole number of at least 1"),
    ("sweep refuses ranks per node in words", "sweep sweeps/nproc_word.yaml",
     "matrix value nproc_per_node=two: must be a whole number"),
    ("sweep refuses fractional ranks per node", "sweep sweeps/nproc_half.yaml",
     "matrix value nproc_per_node=1.5: must be a whole number"),
    ("sweep refuses a boolean rank count", "sweep sweeps/nproc_bool.yaml",
     "matrix value nproc_per_node=True: must be a whole number"),
    ("sweep refuses zero nodes", "sweep sweeps/nnodes_zero.yaml",
     "matrix value nnodes=0: must be a whole number"),
    ("sweep refuses a negative batch per rank", "sweep sweeps/batch_negative.yaml",
     "matrix value batch_per_rank=-4: must be a whole number"),
    ("sweep refuses an unknown SLURM mode", "sweep sweeps/slurm_mode.yaml",
     "matrix value slurm_mode=mpi: must be srun or torchrun"),
    ("sweep refuses a learning rate in words in the matrix", "sweep sweeps/lr_word.yaml",
     "matrix value train.lr=fast: Input should be a valid number"),
    ("sweep refuses an unknown strategy in the matrix", "sweep sweeps/strategy_unknown.yaml",
     "matrix value strategy.name=zero9"),
    ("sweep refuses a GPT layer count in words", "sweep sweeps/n_layer_word.yaml",
     "matrix value model.n_layer=x: Input should be a valid integer"),
    ("sweep refuses matrix values that are not a list", "sweep sweeps/values_scalar.yaml",
     "matrix.train.lr: Input should be a valid list"),
    ("sweep refuses a matrix that is a list", "sweep sweeps/matrix_list.yaml",
     "matrix: Input should be a valid dictionary"),
    ("sweep refuses a matrix key without values", "sweep sweeps/no_values.yaml",
     "matrix key 'seed' has no values"),
    ("sweep refuses an unknown matrix key", "sweep sweeps/unknown_key.yaml",
     "unknown matrix key 'train.lrr'"),
    ("sweep refuses an exclude value that is not in the matrix", "sweep sweeps/exclude_value.yaml",
     "exclude entry {\"seed\": 3}: seed=3 is not in the matrix"),
    ("sweep refuses an exclude key that is not in the matrix", "sweep sweeps/exclude_key.yaml",
     "exclude entry {\"sed\": 1}: 'sed' is not a matrix key"),
    ("sweep refuses a zero run timeout in the spec", "sweep sweeps/timeout_zero.yaml",
     "timeout_s: Input should be greater than 0"),
    ("sweep refuses a nan run timeout in the spec", "sweep sweeps/timeout_nan.yaml",
     "timeout_s: Input should be a finite number"),
    ("sweep refuses a run timeout in words", "sweep sweeps/timeout_word.yaml",
     "timeout_s: Input should be a valid number"),
    ("sweep refuses a negative SLURM poll interval", "sweep sweeps/poll_negative.yaml",
     "slurm.poll_s: Input should be greater than 0"),
    ("sweep refuses an unknown SLURM mode option", "sweep sweeps/slurm_mode_option.yaml",
     "slurm.mode: Input should be 'srun' or 'torchrun'"),
    ("sweep refuses negative GPUs per node", "sweep sweeps/gpus_negative.yaml",
     "slurm.gpus_per_node: Input should be greater than or equal to 0"),
    ("sweep refuses a misspelt SLURM option", "sweep sweeps/slurm_key.yaml",
     "unknown config key 'slurm.partion'"),
    ("sweep refuses a base that is a number", "sweep sweeps/base_number.yaml",
     "base: Input should be a valid string"),
    ("sweep refuses a missing base config", "sweep sweeps/base_missing.yaml",
     "base config file 'absent.yaml' not found"),
    ("sweep refuses a binary base config", "sweep sweeps/base_binary.yaml",
     "is not UTF-8 text"),
    ("sweep refuses an empty base config", "sweep sweeps/base_empty.yaml",
     "remove base: to use the built-in defaults"),
    ("sweep refuses an unknown override key", "sweep sweeps/override_key.yaml",
     "unknown config key 'train.lrr'"),
    ("sweep refuses overrides given as a list", "sweep sweeps/overrides_list.yaml",
     "overrides: Input should be a valid dictionary"),
    ("sweep refuses a bad override value", "sweep sweeps/override_value.yaml",
     "train.lr: Input should be greater than 0"),
    ("sweep refuses several nodes on the local launcher", "sweep sweeps/nnodes_local.yaml",
     "nnodes > 1 needs the slurm launcher"),
    ("sweep refuses a matrix of which nothing can run", "sweep sweeps/nothing_runs.yaml",
     "no combination of the matrix can run"),
    ("sweep refuses a run directory in the overrides", "sweep sweeps/run_dir.yaml",
     "run.dir is chosen by the sweep"),
    ("sweep refuses a zero timeout", "sweep sweeps/ok.yaml --timeout 0",
     "argument --timeout: '0' must be above 0"),
    ("sweep refuses a negative timeout", "sweep sweeps/ok.yaml --timeout -5",
     "argument --timeout: '-5' must be above 0"),
    ("sweep refuses a nan timeout", "sweep sweeps/ok.yaml --timeout nan",
     "argument --timeout: 'nan' is not a finite number"),
    ("sweep refuses an unknown launcher", "sweep sweeps/ok.yaml --launcher ssh",
     "argument --launcher: invalid choice: 'ssh'"),
    ("sweep refuses an output directory that is a file",
     "sweep sweeps/ok.yaml --out earlier/results.csv",
     "--out 'earlier/results.csv': 'earlier/results.csv' is a file"),
    # ------------------------------------------------------------------ collect
    ("collect refuses a missing directory", "collect bad/absent_dir",
     "DIR 'bad/absent_dir' not found"),
    ("collect refuses a file as the directory", "collect earlier/results.csv",
     "DIR 'earlier/results.csv' is not a directory"),
    ("collect refuses an empty directory", "collect bad/empty_dir",
     "'bad/empty_dir' holds no dtlab runs"),
    ("collect refuses a directory without runs or logs", "collect bad/no_runs",
     "'bad/no_runs' holds no dtlab runs"),
    ("collect refuses a second directory without runs", "collect earlier bad/empty_dir",
     "'bad/empty_dir' holds no dtlab runs"),
    ("collect refuses a directory as the output", "collect earlier -o bad",
     "-o/--output 'bad' is a directory"),
    ("collect refuses an output below a file", "collect earlier -o earlier/results.csv/x.csv",
     "'earlier/results.csv' is a file, not a directory"),
    ("collect refuses a binary summary.json", "collect bad/run_binary_summary",
     "bad/run_binary_summary/r1/summary.json' is not a dtlab JSON record"),
    ("collect refuses a summary.json holding a list", "collect bad/run_list_summary",
     "bad/run_list_summary/r1/summary.json' is not a dtlab JSON record"),
    ("collect refuses a damaged compare.json", "collect bad/compare_damaged",
     "bad/compare_damaged/compare.json' is not what dtlab compare writes"),
    # ------------------------------------------------------------------ plot
    ("plot refuses a missing results file", "plot bad/absent.csv",
     "RESULTS_CSV 'bad/absent.csv' not found"),
    ("plot refuses a directory as the results file", "plot earlier",
     "RESULTS_CSV 'earlier' is a directory"),
    ("plot refuses an empty results file", "plot bad/empty.csv",
     "'bad/empty.csv' holds no rows"),
    ("plot refuses a results file of a header only", "plot bad/header_only.csv",
     "'bad/header_only.csv' holds no rows"),
    ("plot refuses a binary results file", "plot bad/binary.csv",
     "'bad/binary.csv' is not a CSV file"),
    ("plot refuses results without a world_size column", "plot bad/no_world_size.csv",
     "'bad/no_world_size.csv' has no world_size column"),
    ("plot refuses results of failed runs only", "plot bad/failed_only.csv",
     "'bad/failed_only.csv' has no finished run with numbers to plot"),
    ("plot refuses a missing collective results file", "plot earlier/results.csv bad/absent.csv",
     "COMM_CSV 'bad/absent.csv' not found"),
    ("plot refuses collective results without sizes and bandwidths",
     "plot earlier/results.csv bad/no_world_size.csv",
     "the collective results have no size_bytes/busbw_gbps columns"),
    ("plot refuses an empty collective results file", "plot earlier/results.csv bad/empty.csv",
     "'bad/empty.csv' holds no rows"),
    ("plot refuses an output directory that is a file", "plot earlier/results.csv -o bad/list.yaml",
     "-o/--output 'bad/list.yaml': 'bad/list.yaml' is a file"),
    # ------------------------------------------------------------------ report
    ("report refuses a missing directory", "report bad/absent_dir",
     "DIR 'bad/absent_dir' not found"),
    ("report refuses a file as the directory", "report earlier/results.csv",
     "DIR 'earlier/results.csv' is not a directory"),
    ("report refuses an empty directory and writes no empty report", "report bad/empty_dir",
     "'bad/empty_dir' holds no dtlab runs"),
    ("report refuses a directory as the report file", "report earlier -o bad",
     "-o/--output 'bad' is a directory"),
    ("report refuses a missing collective results file", "report earlier --comm bad/absent.csv",
     "--comm 'bad/absent.csv' not found"),
    ("report refuses a binary collective results file", "report earlier --comm bad/binary.csv",
     "'bad/binary.csv' is not a CSV file"),
    ("report refuses a damaged run record", "report bad/run_binary_record",
     "bad/run_binary_record/r1/run.json' is not a dtlab JSON record"),
    # ------------------------------------------------------------------ export
    ("export refuses a missing checkpoint", "export bad/absent_dir",
     "CHECKPOINT 'bad/absent_dir' not found"),
    ("export refuses a file as the checkpoint", "export earlier/results.csv",
     "CHECKPOINT 'earlier/results.csv' is not a directory"),
    ("export refuses a directory without a manifest", "export bad/empty_dir",
     "'bad/empty_dir' is not a complete dtlab checkpoint"),
    ("export refuses a directory as the output", "export bad/empty_dir -o bad",
     "-o/--output 'bad' is a directory"),
    # ------------------------------------------------------------------ comm
    ("comm refuses --predict without --fit", "comm --predict all_reduce:64M:8",
     "--predict needs --fit RESULTS"),
    ("comm refuses a missing results file to fit", "comm --fit bad/absent.json",
     "--fit 'bad/absent.json' not found"),
    ("comm refuses a directory to fit", "comm --fit bad", "--fit 'bad' is a directory"),
    ("comm refuses a binary file to fit", "comm --fit bad/binary.yaml",
     "--fit 'bad/binary.yaml' is not a dtlab comm --json file"),
    ("comm refuses a JSON object to fit", "comm --fit bad/object.json",
     "--fit 'bad/object.json' is not a dtlab comm --json file"),
    ("comm refuses an empty JSON list to fit", "comm --fit bad/empty_list.json",
     "--fit 'bad/empty_list.json' is not a dtlab comm --json file"),
    ("comm refuses a JSON list of numbers to fit", "comm --fit bad/numbers.json",
     "--fit 'bad/numbers.json' is not a dtlab comm --json file"),
    ("comm refuses a text file to fit", "comm --fit bad/comments.yaml",
     "--fit 'bad/comments.yaml' is not a dtlab comm --json file"),
    ("comm refuses --json together with --fit", "comm --fit bad/object.json --json out.json",
     "--json apply to a measurement, not to --fit"),
    ("comm refuses --check together with --fit", "comm --fit bad/object.json --check",
     "--check apply to a measurement, not to --fit"),
    ("comm refuses a prediction that is not OP:SIZE:RANKS",
     "comm --fit bad/object.json --predict all_reduce", "--predict 'all_reduce' is not OP:SIZE"),
    ("comm refuses a prediction of an unknown collective",
     "comm --fit bad/object.json --predict allreduce:1M:2", "unknown collective 'allreduce'"),
    ("comm refuses a prediction of an unreadable size",
     "comm --fit bad/object.json --predict all_reduce:big:2", "'big' is not a size"),
    ("comm refuses a prediction of an infinite size",
     "comm --fit bad/object.json --predict all_reduce:inf:2", "'inf' is not a size"),
    ("comm refuses a prediction on zero ranks",
     "comm --fit bad/object.json --predict all_reduce:1M:0", "ranks '0' is not a whole number"),
    ("comm refuses a nan size factor", "comm --factor nan", "--factor nan is not a finite number"),
    ("comm refuses a size factor of 1", "comm --factor 1", "--factor 1 is not a finite number"),
    ("comm refuses an infinite size factor", "comm --factor inf",
     "--factor inf is not a finite number"),
    ("comm refuses a zero timeout", "comm --timeout 0", "--timeout 0 is not a finite number"),
    ("comm refuses a nan timeout", "comm --timeout nan", "--timeout nan is not a finite number"),
    ("comm refuses an infinite smallest size", "comm --min-bytes inf",
     "argument --min-bytes: 'inf' is not a size"),
    ("comm refuses a zero smallest size", "comm --min-bytes 0",
     "argument --min-bytes: size must be at least 1 byte"),
    ("comm refuses a nan largest size", "comm --max-bytes nan",
     "argument --max-bytes: 'nan' is not a size"),
    ("comm refuses a smallest size above the largest", "comm --min-bytes 1M --max-bytes 1K",
     "--min-bytes 1048576 is above --max-bytes 1024"),
    ("comm refuses zero timed repetitions", "comm --iters 0", "--iters 0 --warmup 5"),
    ("comm refuses negative warm-up repetitions", "comm --warmup -1", "--iters 20 --warmup -1"),
    ("comm refuses a directory as the JSON output", "comm --json bad",
     "--json 'bad' is a directory"),
    ("comm refuses a CSV output below a file", "comm --csv earlier/results.csv/comm.csv",
     "'earlier/results.csv' is a file, not a directory"),
    ("comm refuses zero ranks", "comm --nproc-per-node 0",
     "argument --nproc-per-node: '0' must be at least 1"),
    ("comm refuses an unknown collective", "comm --op allreduce",
     "argument --op: invalid choice: 'allreduce'"),
    ("comm refuses an unknown element type", "comm --dtype float64",
     "argument --dtype: invalid choice: 'float64'"),
    # ------------------------------------------------------------------ estimate
    ("estimate refuses a nan parameter count", "estimate --n-params nan",
     "--n-params: 'nan' is not a finite count"),
    ("estimate refuses an infinite parameter count", "estimate --n-params inf",
     "--n-params: 'inf' is not a finite count"),
    ("estimate refuses a negative parameter count", "estimate --n-params -5",
     "--n-params: '-5' must be at least 1"),
    ("estimate refuses half a parameter", "estimate --n-params 0.5",
     "--n-params: '0.5' must be at least 1"),
    ("estimate refuses a parameter count in words", "estimate --n-params seven",
     "argument --n-params: 'seven' is not a count"),
    ("estimate refuses zero ranks", "estimate --n-params 7e9 --world-size 0",
     "argument --world-size: '0' must be at least 1"),
    ("estimate refuses infinitely many ranks", "estimate --n-params 7e9 --world-size inf",
     "--world-size: 'inf' is not a whole number"),
    ("estimate refuses a fractional rank count", "estimate --n-params 7e9 --world-size 2.5",
     "--world-size: '2.5' is not a whole number"),
    ("estimate refuses a nan bandwidth", "estimate --n-params 7e9 --bandwidth nan",
     "--bandwidth: 'nan' is not a finite number"),
    ("estimate refuses a negative bandwidth", "estimate --n-params 7e9 --bandwidth -1",
     "argument --bandwidth: '-1' must be above 0"),
    ("estimate refuses an infinite inter-node bandwidth",
     "estimate --n-params 7e9 --bandwidth 100 --inter-node-bandwidth inf",
     "--inter-node-bandwidth: 'inf' is not a finite number"),
    ("estimate refuses a strategy list of commas", "estimate --n-params 7e9 --strategies ,",
     "--strategies ',' names no strategy"),
    ("estimate refuses binary collective results", "estimate --n-params 7e9 --comm-results "
     "bad/binary.yaml", "--comm-results 'bad/binary.yaml' is not a dtlab comm"),
    ("estimate refuses a directory as collective results",
     "estimate --n-params 7e9 --comm-results bad", "--comm-results 'bad' is a directory"),
    ("estimate refuses a negative sequence length", "estimate --n-params 7e9 --seq-len -1",
     "argument --seq-len: '-1' must be at least 1"),
    ("estimate refuses a zero micro batch", "estimate --n-params 7e9 --micro-batch 0",
     "argument --micro-batch: '0' must be at least 1"),
    ("estimate refuses a nan layer count", "estimate --n-params 7e9 --n-layer nan",
     "--n-layer: 'nan' is not a whole number"),
    ("estimate refuses a binary config file", "estimate --config bad/binary.yaml",
     "config file 'bad/binary.yaml' is not UTF-8 text"),
    # ------------------------------------------------------------------ advise
    ("advise refuses a nan reserve", "advise --n-params 7e9 --gpus 8 --gpu-memory 80 --reserve nan",
     "argument --reserve: 'nan' is not a finite number"),
    ("advise refuses a negative reserve",
     "advise --n-params 7e9 --gpus 8 --gpu-memory 80 --reserve -1",
     "argument --reserve: '-1' must be at least 0"),
    ("advise refuses infinite GPU memory", "advise --n-params 7e9 --gpus 8 --gpu-memory inf",
     "--gpu-memory: 'inf' is not a finite number"),
    ("advise refuses zero GPUs", "advise --n-params 7e9 --gpus 0 --gpu-memory 80",
     "argument --gpus: '0' must be at least 1"),
    ("advise refuses nan host memory",
     "advise --n-params 7e9 --gpus 8 --gpu-memory 80 --host-memory nan",
     "--host-memory: 'nan' is not a finite number"),
    ("advise needs the GPU count", "advise --n-params 7e9 --gpu-memory 80",
     "the following arguments are required: --gpus"),
    # ------------------------------------------------------------------ doctor
    ("doctor refuses a zero timeout", "doctor --timeout 0", "argument --timeout: '0' must be above"),
    ("doctor refuses a nan timeout", "doctor --timeout nan",
     "argument --timeout: 'nan' is not a finite number"),
    ("doctor refuses a negative timeout", "doctor --timeout -1",
     "argument --timeout: '-1' must be above 0"),
    ("doctor refuses zero ranks per node", "doctor --nproc-per-node 0",
     "argument --nproc-per-node: '0' must be at least 1"),
    ("doctor refuses ranks per node in words", "doctor --nproc-per-node x",
     "argument --nproc-per-node: 'x' is not a whole number"),
]

GPT = "model.name=gpt data.name=tokens run.dir=bad/never"  # {gpt} in CASES

SPECS = {  # sweeps/NAME.yaml; BASE is the shipped quick config
    "ok": "base: BASE\nmatrix: {seed: [1]}",
    "matrics": "base: BASE\nmatrics: {seed: [1]}",
    "nproc_zero": "base: BASE\nmatrix: {nproc_per_node: [1, 0]}",
    "nproc_word": "base: BASE\nmatrix: {nproc_per_node: [two]}",
    "nproc_half": "base: BASE\nmatrix: {nproc_per_node: [1.5]}",
    "nproc_bool": "base: BASE\nmatrix: {nproc_per_node: [true]}",
    "nnodes_zero": "base: BASE\nmatrix: {nnodes: [0]}",
    "batch_negative": "base: BASE\nmatrix: {batch_per_rank: [-4]}",
    "slurm_mode": "base: BASE\nmatrix: {slurm_mode: [mpi]}",
    "lr_word": "base: BASE\nmatrix: {train.lr: [0.1, fast]}",
    "strategy_unknown": "base: BASE\nmatrix: {strategy.name: [ddp, zero9]}",
    "n_layer_word": "base: BASE\nmatrix: {model.name: [gpt], model.n_layer: [x]}",
    "values_scalar": "base: BASE\nmatrix: {train.lr: 0.1}",
    "matrix_list": "base: BASE\nmatrix: [1, 2]",
    "no_values": "base: BASE\nmatrix: {seed: []}",
    "unknown_key": "base: BASE\nmatrix: {train.lrr: [0.1]}",
    "exclude_value": "base: BASE\nmatrix: {seed: [1, 2]}\nexclude: [{seed: 3}]",
    "exclude_key": "base: BASE\nmatrix: {seed: [1, 2]}\nexclude: [{sed: 1}]",
    "timeout_zero": "base: BASE\ntimeout_s: 0",
    "timeout_nan": "base: BASE\ntimeout_s: .nan",
    "timeout_word": "base: BASE\ntimeout_s: long",
    "poll_negative": "base: BASE\nslurm: {poll_s: -1}",
    "slurm_mode_option": "base: BASE\nslurm: {mode: mpi}",
    "gpus_negative": "base: BASE\nslurm: {gpus_per_node: -1}",
    "slurm_key": "base: BASE\nslurm: {partion: gpu}",
    "base_number": "base: 5",
    "base_missing": "base: absent.yaml",
    "base_binary": "base: ../bad/binary.yaml",
    "base_empty": "base: ../bad/empty.yaml",
    "override_key": "base: BASE\noverrides: {train.lrr: 1}",
    "overrides_list": "base: BASE\noverrides: [1]",
    "override_value": "base: BASE\noverrides: {train.lr: -1}",
    "nnodes_local": "base: BASE\nmatrix: {nnodes: [2]}",
    "run_dir": "base: BASE\noverrides: {run.dir: mine}",
    "nothing_runs": "base: BASE\nmatrix: {strategy.name: [single], nproc_per_node: [2]}",
}

FILES = {  # bad/NAME: content
    "binary.yaml": b"\x00\x01\xff\xfe\x80dtlab",
    "utf16.yaml": "train: {lr: 0.1}\n".encode("utf-16"),
    "latin1.yaml": "# réglages\ntrain: {lr: 0.1}\n".encode("latin-1"),
    "empty.yaml": b"",
    "comments.yaml": b"# nothing set here\n# at all\n",
    "list.yaml": b"- train\n- model\n",
    "scalar.yaml": b"quick\n",
    "bracket.yaml": b"train:\n  lr: [0.1\n",
    "tab.yaml": b"train:\n\tlr: 0.1\n",
    "two_docs.yaml": b"train: {lr: 0.1}\n---\ntrain: {lr: 0.2}\n",
    "python_tag.yaml": b"train: !!python/object/apply:os.system ['true']\n",
    "unreadable.yaml": b"train: {lr: 0.1}\n",
    "int_key.yaml": b"1: 2\n",
    "list_section.yaml": b"train: [1, 2]\n",
    "unknown_section.yaml": b"trainer: {lr: 0.1}\n",
    "misspelt.yaml": b"train: {lrr: 0.1}\n",
    "bad_value.yaml": b"train: {lr: -1}\n",
    "model_word.yaml": b"model: gpt\n",
    "empty.csv": b"",
    "header_only.csv": b"series,strategy,world_size,status,samples_per_s\n",
    "binary.csv": b"\xff\xfe\x00\x00" * 8,
    "no_world_size.csv": b"series,samples_per_s\nddp,100\n",
    "failed_only.csv": b"series,strategy,world_size,status,samples_per_s\nddp,ddp,2,failed,\n",
    "object.json": b'{"op": "all_reduce"}',
    "empty_list.json": b"[]",
    "numbers.json": b"[1, 2, 3]",
    "no_runs/notes.md": b"no runs here\n",
    "run_binary_summary/r1/summary.json": b"\x80\x81\x82",
    "run_list_summary/r1/summary.json": b"[1, 2]",
    "run_binary_record/r1/run.json": b"\xff\xfe",
    "compare_damaged/ddp/summary.json": json.dumps({"strategy": "ddp", "world_size": 2}).encode(),
    "compare_damaged/compare.json": b'{"strategy": "ddp"}',
    "tokens_empty/train.bin": b"",
    "tokens_empty/val.bin": b"",
    "tokens_odd/train.bin": b"abc",
    "tokens_odd/val.bin": bytes(400),
    "ds_list.json": b"[1, 2]",
    "tokens_meta_text/meta.json": b"{vocab_size: 256",
    "tokens_meta_list/meta.json": b"[256]",
    "tokens_meta_negative/meta.json": b'{"vocab_size": -1}',
    "tokens_meta_int8/meta.json": b'{"vocab_size": 256, "dtype": "int8"}',
    "tokens_uint32_6/meta.json": b'{"vocab_size": 256, "dtype": "uint32"}',
    "tokens_uint32_6/train.bin": bytes(6),
    "tokens_short/train.bin": np.arange(10, dtype=np.uint16).tobytes(),
    "tokens_big_ids/train.bin": np.arange(300, dtype=np.uint16).tobytes(),
    "tokens_no_val/train.bin": np.arange(200, dtype=np.uint16).tobytes(),
}
for _name in ("tokens_meta_text", "tokens_meta_list", "tokens_meta_negative", "tokens_short",
              "tokens_big_ids", "tokens_meta_int8", "tokens_uint32_6"):
    FILES.setdefault(f"{_name}/train.bin", np.arange(200, dtype=np.uint16).tobytes())
    FILES[f"{_name}/val.bin"] = np.arange(200, dtype=np.uint16).tobytes()

EARLIER_SUMMARY = {
    "strategy": "ddp", "strategy_options": {}, "world_size": 2, "nnodes": 1,
    "samples_per_s": 1800.0, "median_step_time_s": 0.035, "epoch_time_s": 2.3, "val_loss": 1.0,
    "val_acc": 0.5, "final_train_loss": 1.1, "device": "cpu", "backend": "gloo",
    "memory_per_rank": {"peak_rss_bytes": [1 << 28] * 2, "param_bytes": [1 << 20] * 2,
                        "grad_bytes": [1 << 20] * 2, "optim_bytes": [1 << 20] * 2},
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Earlier results (a run, results.csv) and every bad file the cases name."""
    ws = tmp_path_factory.mktemp("bad_inputs")
    run = ws / "earlier" / "ddp"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(EARLIER_SUMMARY))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.3}\n')
    (ws / "earlier" / "results.csv").write_text(
        "series,strategy,world_size,status,samples_per_s\nddp,ddp,2,done,1800.0\n")
    for name, content in FILES.items():
        path = ws / "bad" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    (ws / "bad" / "unreadable.yaml").chmod(0)
    for name in ("empty_dir", "no_tokens"):
        (ws / "bad" / name).mkdir()
    (ws / "sweeps").mkdir()
    for name, text in SPECS.items():
        (ws / "sweeps" / f"{name}.yaml").write_text(text.replace("BASE", str(CONFIGS / "quick.yaml"))
                                                    + "\n")
    return ws


def snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under root with a digest of its content and its mtime."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_dir():
            out[rel] = "dir"
        elif os.access(path, os.R_OK):
            st = path.stat()
            out[rel] = f"{hashlib.sha256(path.read_bytes()).hexdigest()} {st.st_mtime_ns}"
        else:
            out[rel] = f"unreadable {path.stat().st_mtime_ns}"
    return out


def children() -> set[int]:
    """Processes whose parent is this one."""
    me, found = os.getpid(), set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.add(int(entry.name))
    return found


@pytest.mark.parametrize(("what", "line", "expected"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_with_the_fix_and_exit_2(workspace: Path, what: str, line: str,
                                                       expected: str) -> None:
    """Refused in one line naming the key or path with the fix, exit 2, nothing started or written."""
    if "unreadable.yaml" in line and os.access(workspace / "bad" / "unreadable.yaml", os.R_OK):
        pytest.skip("running as root: a file without read permission can still be read")
    line = refused(shlex.split(line.format(configs=CONFIGS, gpt=GPT)), workspace, quiet=True)
    assert expected in line, line


def refused(args: list[str], workspace: Path, quiet: bool = False) -> str:
    """`dtlab ARGS` in workspace: exit 2 with one `dtlab: error: ...; fix: ...` line (returned),
    no traceback, nothing left running, no file changed (`quiet`: nothing on stdout either)."""
    before, running = snapshot(workspace), children()
    proc = dtlab(*args, cwd=workspace)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stdout + proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("dtlab: error: ") and "; fix: " in lines[0], lines[0]
    assert not quiet or proc.stdout == "", proc.stdout
    assert children() <= running, "a process started by the command is still running"
    assert snapshot(workspace) == before, "the command changed files it was not asked to"
    return lines[0]


def test_cases_are_distinct() -> None:
    """At least 150 cases, each its own input: no id, command line or sweep spec twice."""
    assert len(CASES) >= 150
    assert len({c[0] for c in CASES}) == len(CASES), "two cases share an id"
    assert len({c[1] for c in CASES}) == len(CASES), "two cases run the same command line"
    specs = [SPECS[c[1].split()[1].removeprefix("sweeps/").removesuffix(".yaml")]
             for c in CASES if c[1].startswith("sweep sweeps/") and c[1].count(" ") == 1]
    assert len(set(specs)) == len(specs), "two sweep cases use the same spec"


def test_the_real_command_says_it_once_without_a_traceback(workspace: Path) -> None:
    """Through `python -m dtlab` too: one line, exit 2, no traceback (2-rank tokens, a sweep spec).

    The console script's own exit path: a 2-rank train whose token file is empty, a sweep spec
    asking for 0 ranks."""
    for args, expected in (
            (["train", "--nproc-per-node", "2", *GPT.split(), "strategy.name=ddp",
              "data.dir=bad/tokens_empty"], "bad/tokens_empty/train.bin is empty; fix: "),
            (["sweep", "sweeps/nproc_zero.yaml"], "matrix value nproc_per_node=0")):
        before = snapshot(workspace)
        proc = cli(*args, cwd=workspace, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and expected in proc.stderr, proc.stderr
        assert snapshot(workspace) == before


UNITS = {"timeout": "second", "bytes": "bytes", "memory": "GB", "bandwidth": "GB/s",
         "tolerance": "relative", "seq_len": "tokens", "vocab": "tokens"}


def test_every_option_of_every_subcommand_says_what_it_does_and_its_default() -> None:
    """`--help` of every subcommand: each option has a sentence, its default and its unit."""
    from dtlab.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert {"train", "compare", "sweep", "collect", "plot", "report", "comm", "estimate", "advise",
            "export", "config", "doctor"} <= set(commands)
    for name, sub in commands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.help == "==SUPPRESS==" or action.dest == "help":
                continue
            flag = f"dtlab {name} {action.option_strings[-1]}"
            text = formatter._expand_help(action) if action.help else ""
            assert len(text.split()) >= 3, f"{flag} has no sentence: {text!r}"
            assert "default" in text, f"{flag} does not say its default: {text!r}"
            for part, unit in UNITS.items():
                if part in action.dest:
                    assert unit in text, f"{flag} does not give its unit ({unit}): {text!r}"
        assert dtlab(name, "--help").returncode == 0
