"""End to end on CPU under skyrl-train 0.3.1: the same tests as ``tests/test_e2e_grpo.py`` (the demo
command killed and resumed, bitwise sync, logprobs, reward, export, LoRA adapter sync, console), which
runs under skyrl 0.4; here through 0.3.1's trainer, our CPU engine and the host's broadcast sender."""

from test_e2e_grpo import (  # noqa: F401  (pytest collects the imported tests and fixture)
    interrupted_then_resumed,
    pytestmark,
    test_engine_holds_the_policy_weights_bitwise_and_reports_the_trainers_logprobs,
    test_killed_worker_fails_the_run_by_name_and_leaves_only_complete_checkpoints,
    test_lora_demo_syncs_adapters_to_the_engine_by_one_override_more,
    test_resume_continues_after_the_last_checkpoint_with_the_same_data_order,
    test_reward_goes_up_and_the_final_export_holds_the_trained_policy,
    test_the_console_shows_the_step_table_and_little_else,
)
