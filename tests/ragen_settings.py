"""RAGEN's settings in three versions, as test data for tests/test_ragen_versions.py: for each of its experiment
files _1_bandit, _2_sokoban and _3_frozen_lake, every key the porter reads once config/base.yaml and config/envs.yaml
are merged in and ${...} interpolations resolved (a ${...} naming a verl default stays as written), flattened to
dotted keys; the custom_envs entries of the tags an experiment uses, nested. COMMON holds what the three experiments
share. Written down key by key from the configs at the commits named in SOURCES: the paper-time version in full, each
later one as the version before it plus a diff (``revised``: keys added, changed, removed), so that the diff is also
the record of what RAGEN changed.
"""

# ruff: noqa: E501

import copy

SOURCES = {
    'paper': ('RAGEN-AI/RAGEN', '385bc30df3bc9b9e48ae26360ef8bfa5301ac5a2', 'the v0423 merge, 2025-04-23 (paper time)'),
    'sept': ('RAGEN-AI/RAGEN', '5eb79b82cecc31db5662ba3c96b752405692410b', 'main, 2025-09-06'),
    'today': ('mll-lab-nu/RAGEN', '20daedc47558e000f7de912b060646bf2e8026bd', 'main, 2026-04-14 (RAGEN-2)'),
}


def revised(earlier: dict, *, added: dict | None = None, changed: dict | None = None, removed: tuple = ()) -> dict:
    """A copy of the settings `earlier` with the keys `added` put in (at the end), the keys `changed` given new values
    and the keys `removed` taken out. ValueError when the diff does not fit `earlier` (a key added that is there, a key
    changed or removed that is not, a change to the value it had), so that a diff is exact."""
    added, changed = added or {}, changed or {}
    problems = [f"added {k!r} is already there" for k in added if k in earlier]
    problems += [f"{what} {k!r} is not there" for what, keys in (("changed", changed), ("removed", removed))
                 for k in keys if k not in earlier]
    problems += [f"changed {k!r} keeps its value {v!r}" for k, v in changed.items() if k in earlier and earlier[k] == v]
    if problems:
        raise ValueError("; ".join(problems))
    out = {k: changed.get(k, v) for k, v in earlier.items() if k not in removed}
    return copy.deepcopy({**out, **added})


#: Paper time: each experiment file sets its micro-batch size (8 for Bandit, 4 for the grids) under these six keys;
#: from September 2025 on, base.yaml sets them all to 1.
MICRO_BATCH_KEYS = ('micro_batch_size_per_gpu',
                    'actor_rollout_ref.actor.micro_batch_size_per_gpu',
                    'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu',
                    'actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu',
                    'actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu',
                    'critic.ppo_micro_batch_size_per_gpu')

# ------------------------------------------------------------------------------------ April 2025 (paper time)
COMMON_PAPER = {'system.CUDA_VISIBLE_DEVICES': '0',
 'ppo_mini_batch_size': 32,
 'model_path': 'Qwen/Qwen2.5-0.5B-Instruct',
 'enable_response_mask': False,
 'grpo_advantage_length_weight': False,
 'lora.enabled': False,
 'lora.rank': 64,
 'lora.alpha': 64,
 'lora.target_modules': 'all-linear',
 'lora.local_temp_dir': 'lora_temp',
 'actor_rollout_ref.model.path': 'Qwen/Qwen2.5-0.5B-Instruct',
 'actor_rollout_ref.actor.ppo_mini_batch_size': 32,
 'actor_rollout_ref.actor.use_ref': True,
 'actor_rollout_ref.actor.entropy_coeff': 0.001,
 'actor_rollout_ref.actor.use_kl_loss': False,
 'actor_rollout_ref.actor.kl_loss_coef': 0.0,
 'actor_rollout_ref.actor.kl_loss_type': 'kl',
 'actor_rollout_ref.actor.clip_ratio_low': 0.2,
 'actor_rollout_ref.actor.clip_ratio_high': 0.28,
 'actor_rollout_ref.actor.grpo_advantage_length_weight': False,
 'actor_rollout_ref.actor.optim.betas': [0.9, 0.999],
 'actor_rollout_ref.actor.lora.enabled': False,
 'actor_rollout_ref.actor.lora.rank': 64,
 'actor_rollout_ref.actor.lora.alpha': 64,
 'actor_rollout_ref.actor.lora.target_modules': 'all-linear',
 'actor_rollout_ref.actor.lora.local_temp_dir': 'lora_temp',
 'actor_rollout_ref.rollout.tensor_model_parallel_size': 1,
 'actor_rollout_ref.rollout.max_model_len': 3600,
 'actor_rollout_ref.rollout.prompt_length': 1,
 'actor_rollout_ref.rollout.gpu_memory_utilization': 0.5,
 'actor_rollout_ref.rollout.max_num_batched_tokens': 8192,
 'actor_rollout_ref.rollout.temperature': 1,
 'actor_rollout_ref.rollout.rollout_filter_ratio': 0.25,
 'actor_rollout_ref.rollout.rollout_filter_type': 'std',
 'actor_rollout_ref.rollout.enforce_eager': False,
 'actor_rollout_ref.rollout.free_cache_engine': False,
 'actor_rollout_ref.rollout.val_kwargs.do_sample': True,
 'actor_rollout_ref.rollout.val_kwargs.temperature': 0.5,
 'actor_rollout_ref.rollout.lora.enabled': False,
 'actor_rollout_ref.rollout.lora.rank': 64,
 'actor_rollout_ref.rollout.lora.alpha': 64,
 'actor_rollout_ref.rollout.lora.target_modules': 'all-linear',
 'actor_rollout_ref.rollout.lora.local_temp_dir': 'lora_temp',
 'critic.ppo_mini_batch_size': 32,
 'critic.model.path': 'Qwen/Qwen2.5-0.5B-Instruct',
 'critic.optim.betas': [0.9, 0.999],
 'critic.lora.enabled': False,
 'critic.lora.rank': 64,
 'critic.lora.alpha': 64,
 'critic.lora.target_modules': 'all-linear',
 'data.max_prompt_length': None,
 'data.max_response_length': None,
 'data.train_batch_size': None,
 'algorithm.gamma': 1.0,
 'algorithm.lam': 1.0,
 'algorithm.adv_estimator': 'gae',
 'algorithm.kl_penalty': 'kl',
 'algorithm.kl_ctrl.type': 'fixed',
 'algorithm.kl_ctrl.kl_coef': 0.0,
 'trainer.project_name': 'ragen_latest',
 'trainer.total_training_steps': 200,
 'trainer.validation_steps': 1,
 'trainer.val_before_train': True,
 'trainer.n_gpus_per_node': 1,
 'trainer.test_freq': 10,
 'trainer.generations_to_log_to_wandb.train': 128,
 'trainer.generations_to_log_to_wandb.val': 20,
 'trainer.logger': ['console', 'wandb'],
 'agent_proxy.action_sep': '||',
 'agent_proxy.use_turn_scores': False,
 'agent_proxy.enable_think': True,
 'agent_proxy.reward_normalization.grouping': 'state',
 'agent_proxy.reward_normalization.method': 'identity',
 'es_manager.format_penalty': -0.1,
 'es_manager.train.env_groups': 8,
 'es_manager.train.group_size': 16,
 'es_manager.train.env_configs.n_groups': [8],
 'es_manager.val.group_size': 1,
 'ctx_manager.generation.gen_config.temperature': 1,
 'ctx_manager.generation.gen_config.top_p': '${actor_rollout_ref.rollout.top_p}',
 'ctx_manager.generation.gen_config.top_k': '${actor_rollout_ref.rollout.top_k}',
 'ctx_manager.generation.gen_config.kwargs': None}

_SOKOBAN_PAPER = {**dict.fromkeys(MICRO_BATCH_KEYS, 4),
                  'actor_rollout_ref.rollout.response_length': 400,
                  'trainer.experiment_name': 'sokoban-main',
                  'agent_proxy.max_turn': 5,
                  'agent_proxy.max_actions_per_turn': 5,
                  'es_manager.train.env_configs.tags': ['SimpleSokoban'],
                  'es_manager.val.env_groups': 256,
                  'es_manager.val.env_configs.tags': ['SimpleSokoban'],
                  'es_manager.val.env_configs.n_groups': [256],
                  'ctx_manager.generation.gen_config.response_length': 400}

EXPERIMENTS_PAPER = {
    '_1_bandit': {**dict.fromkeys(MICRO_BATCH_KEYS, 8),
                  'actor_rollout_ref.rollout.response_length': 500,
                  'trainer.experiment_name': 'bandit-base',
                  'agent_proxy.max_turn': 1,
                  'agent_proxy.max_actions_per_turn': 1,
                  'es_manager.train.env_configs.tags': ['Bandit'],
                  'es_manager.val.env_groups': 512,
                  'es_manager.val.env_configs.tags': ['Bandit', 'BanditTest'],
                  'es_manager.val.env_configs.n_groups': [256, 256],
                  'ctx_manager.generation.gen_config.response_length': 500},
    '_2_sokoban': _SOKOBAN_PAPER,
    # the FrozenLake file is the Sokoban one with its own name and tag
    '_3_frozen_lake': revised(_SOKOBAN_PAPER, changed={'trainer.experiment_name': 'frozenlake-main',
                                                       'es_manager.train.env_configs.tags': ['FrozenLake'],
                                                       'es_manager.val.env_configs.tags': ['FrozenLake']}),
}

CUSTOM_ENVS_PAPER = {
    '_1_bandit': {'Bandit': {'env_type': 'bandit',
                 'max_actions_per_traj': 1,
                 'env_instruction': '',
                 'max_tokens': 100,
                 'env_config': {'lo_arm_name': 'Phoenix', 'hi_arm_name': 'Dragon'}},
      'BanditTest': {'env_type': 'bandit',
                     'max_actions_per_traj': 1,
                     'env_instruction': '',
                     'max_tokens': 100,
                     'env_config': {'lo_arm_name': 'Trader', 'hi_arm_name': 'Librarian'}}},
    '_2_sokoban': {'SimpleSokoban': {'env_type': 'sokoban',
                        'max_actions_per_traj': 10,
                        'env_instruction': 'You are solving the Sokoban puzzle. You are the player and you need '
                                           'to push all boxes to targets. When you are right next to a box, you '
                                           'can push it by moving in the same direction. You cannot push a box '
                                           'through a wall, and you cannot pull a box. The answer should be a '
                                           'sequence of actions, like <answer>Right || Right || Up</answer>',
                        'max_tokens': 100,
                        'env_config': {'dim_x': 6, 'dim_y': 6, 'num_boxes': 1, 'max_steps': 100}}},
    '_3_frozen_lake': {'FrozenLake': {'env_type': 'frozen_lake',
                     'max_actions_per_traj': 10,
                     'env_instruction': 'You are solving the FrozenLake puzzle. Forbid the whole and go to the '
                                        'target. You may move to the unintended direction due to the slippery '
                                        'ice. Example answer format: <think>To forbid the hole and go to the '
                                        'target, I should go left then go up.</think><answer>Left || Up</answer>',
                     'max_tokens': 100,
                     'env_config': None}},
}

# ------------------------------------------------------------------------------------ September 2025
# LoRA moves from a block per role (lora.enabled, rank 64) to actor_rollout_ref.model / critic.model lora_rank (0:
# off); the micro-batch sizes move to base.yaml; seeds, the bi-level GAE options and max_context_window appear;
# response masks are on and vLLM runs eager.
COMMON_SEPT = revised(
    COMMON_PAPER,
    added={'seed.train': 10000,
           'seed.val': 123,
           **dict.fromkeys(MICRO_BATCH_KEYS, 1),
           'actor_rollout_ref.model.lora_rank': 0,
           'actor_rollout_ref.model.lora_alpha': 16,
           'actor_rollout_ref.model.target_modules': 'all-linear',
           'actor_rollout_ref.rollout.tp_size_check': True,
           'critic.model.lora_rank': 0,
           'critic.model.lora_alpha': 16,
           'critic.model.target_modules': 'all-linear',
           'algorithm.high_level_gamma': 0.95,
           'algorithm.bi_level_gae': False,
           'agent_proxy.max_context_window': -1},
    changed={'enable_response_mask': True,
             'lora.rank': 0,
             'lora.alpha': 16,
             'actor_rollout_ref.rollout.enforce_eager': True,
             'actor_rollout_ref.rollout.free_cache_engine': True},
    removed=('lora.enabled', 'lora.local_temp_dir',
             'actor_rollout_ref.actor.lora.enabled', 'actor_rollout_ref.actor.lora.rank',
             'actor_rollout_ref.actor.lora.alpha', 'actor_rollout_ref.actor.lora.target_modules',
             'actor_rollout_ref.actor.lora.local_temp_dir',
             'actor_rollout_ref.rollout.lora.enabled', 'actor_rollout_ref.rollout.lora.rank',
             'actor_rollout_ref.rollout.lora.alpha', 'actor_rollout_ref.rollout.lora.target_modules',
             'actor_rollout_ref.rollout.lora.local_temp_dir',
             'critic.lora.enabled', 'critic.lora.rank', 'critic.lora.alpha', 'critic.lora.target_modules'))

EXPERIMENTS_SEPT = {name: revised(settings, removed=MICRO_BATCH_KEYS) for name, settings in EXPERIMENTS_PAPER.items()}

CUSTOM_ENVS_SEPT = copy.deepcopy(CUSTOM_ENVS_PAPER)  # the tags the experiments use are unchanged

# ------------------------------------------------------------------------------------ April 2026 (RAGEN-2)
# The 3B model; RAGEN-2's rollout filter family (top_p / largest over reward variance) in place of the std ratio;
# advantage options, gradient analysis, collapse detection, checkpoint counts; the validation groups (512) move to
# base.yaml; the grid experiments switch to the coordinate tags with 2 actions per turn.
COMMON_TODAY = revised(
    COMMON_SEPT,
    added={'log_prob_micro_batch_size_per_gpu': 1,
           'actor_rollout_ref.actor.filter_loss_scaling': 'none',
           'actor_rollout_ref.actor.loss_agg_mode': 'token-mean',
           'actor_rollout_ref.actor.optim.lr': '1e-6',
           'actor_rollout_ref.rollout.name': 'vllm',
           'actor_rollout_ref.rollout.load_format': 'auto',
           'actor_rollout_ref.rollout.rollout_filter_value': 1.0,
           'actor_rollout_ref.rollout.rollout_filter_strategy': 'top_p',
           'actor_rollout_ref.rollout.rollout_filter_include_zero': True,
           'actor_rollout_ref.rollout.rollout_filter_top_p_prob_mode': 'linear',
           'actor_rollout_ref.rollout.rollout_filter_selection_eps': 0.01,
           'actor_rollout_ref.rollout.rollout_filter_empty_stop_steps': 5,
           'actor_rollout_ref.rollout.rollout_filter_metric': 'reward_variance',
           'actor_rollout_ref.rollout.gradient_analysis_num_buckets': 6,
           'actor_rollout_ref.rollout.gradient_analysis_bucket_mode': 'quantile',
           'critic.optim.lr': '1e-5',
           'algorithm.zero_task_advantage': False,
           'algorithm.norm_adv_by_std_in_grpo': True,
           'algorithm.soft_advantage_reweight': False,
           'trainer.local_log_dir': 'results/',
           'trainer.save_freq': 100,
           'trainer.max_actor_ckpt_to_keep': 1,
           'trainer.max_critic_ckpt_to_keep': 1,
           'trainer.log_group_rv_table': False,
           'trainer.gradient_analysis_mode': False,
           'trainer.gradient_analysis_every': 50,
           'trainer.gradient_analysis_env_groups': None,
           'trainer.gradient_analysis_group_size': None,
           'trainer.gradient_analysis_log_prefilter': False,
           'trainer.gradient_analysis_only': False,
           'trainer.exit_after_gradient_analysis': False,
           'agent_proxy.context_window_mode': 'full',
           'agent_proxy.batch_adjust_mode': 'copy',
           'collapse_detection.compute_freq': 5,
           'collapse_detection.micro_batch_size': 128,
           'collapse_detection.first_turn_enabled': True,
           'collapse_detection.multi_turn_enabled': True,
           'collapse_detection.num_samples': 64,
           'es_manager.val.env_groups': 512,
           'hydra.searchpath': ['pkg://verl.trainer.config']},
    changed={'model_path': 'Qwen/Qwen2.5-3B-Instruct',
             'lora.alpha': 64,
             'actor_rollout_ref.model.path': 'Qwen/Qwen2.5-3B-Instruct',
             'actor_rollout_ref.model.lora_alpha': 64,
             'actor_rollout_ref.rollout.gpu_memory_utilization': 0.3,
             'actor_rollout_ref.rollout.rollout_filter_type': 'largest',
             'critic.model.path': 'Qwen/Qwen2.5-3B-Instruct',
             'critic.model.lora_alpha': 64,
             'trainer.project_name': 'ragen'},
    removed=('actor_rollout_ref.actor.micro_batch_size_per_gpu',
             'actor_rollout_ref.rollout.rollout_filter_ratio',
             'actor_rollout_ref.rollout.tp_size_check',
             'trainer.generations_to_log_to_wandb.train'))

_COORD_CHANGES = {  # per experiment: what its file changes besides dropping es_manager.val.env_groups
    '_1_bandit': {},
    '_2_sokoban': {'agent_proxy.max_actions_per_turn': 2,
                   'es_manager.train.env_configs.tags': ['CoordSokoban'],
                   'es_manager.val.env_configs.tags': ['CoordSokoban'],
                   'es_manager.val.env_configs.n_groups': [512]},
    '_3_frozen_lake': {'agent_proxy.max_actions_per_turn': 2,
                       'es_manager.train.env_configs.tags': ['CoordFrozenLake'],
                       'es_manager.val.env_configs.tags': ['CoordFrozenLake'],
                       'es_manager.val.env_configs.n_groups': [512]},
}
EXPERIMENTS_TODAY = {name: revised(settings, changed=_COORD_CHANGES[name], removed=('es_manager.val.env_groups',))
                     for name, settings in EXPERIMENTS_SEPT.items()}

#: RAGEN-2 gives every custom env these two keys (its thread pool of env workers).
_WORKER_KEYS = {'parallel_friendly': False, 'max_workers': 32}
_BANDIT, _SOKOBAN, _FROZEN_LAKE = (CUSTOM_ENVS_SEPT[name] for name in ('_1_bandit', '_2_sokoban', '_3_frozen_lake'))

#: The env_instruction of RAGEN-2's coordinate tags, a line of its text per line.
COORD_SOKOBAN_INSTRUCTION = (
    'You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets.\n'
    'You are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and each target. \n'
    'Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5). \n'
    'When you are exactly next to a box, you can push it by moving in the same direction. \n'
    'You cannot push a box through a wall, and you cannot pull a box.\n'
    'The answer should be a sequence of actions, like <answer>Right || Right || Up</answer>.\n')
COORD_FROZEN_LAKE_INSTRUCTION = (
    'You are solving the FrozenLake puzzle. The observation includes both a symbol grid and zero-indexed coordinates for the start, goal, player, and any holes.\n'
    'Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5).\n'
    'Beware that the ice is slippery, so the agent might slide and end up in an unintended tile.\n'
    'Respond with a sequence of actions such as <answer>Left || Up || Up</answer>.\n')

# Bandit's tags draw their arm names from a split; each grid experiment's new tag is its old tag's entry with the
# coordinate observation, its instruction and 120 tokens.
CUSTOM_ENVS_TODAY = {
    '_1_bandit': {'Bandit': revised(_BANDIT['Bandit'], added=_WORKER_KEYS, changed={'env_config': {'split': 'train'}}),
                  'BanditTest': revised(_BANDIT['BanditTest'], added=_WORKER_KEYS,
                                        changed={'env_config': {'split': 'test'}})},
    '_2_sokoban': {'CoordSokoban': revised(
        _SOKOBAN['SimpleSokoban'], added=_WORKER_KEYS,
        changed={'env_instruction': COORD_SOKOBAN_INSTRUCTION, 'max_tokens': 120,
                 'env_config': revised(_SOKOBAN['SimpleSokoban']['env_config'],
                                       added={'observation_format': 'grid_coord'})})},
    '_3_frozen_lake': {'CoordFrozenLake': revised(
        _FROZEN_LAKE['FrozenLake'], added=_WORKER_KEYS,
        changed={'env_instruction': COORD_FROZEN_LAKE_INSTRUCTION, 'max_tokens': 120,
                 'env_config': {'observation_format': 'grid_coord', 'success_rate': 1}})},
}
