"""PPO with GAE on a Megatron critic under skyrl-train 0.3.1: ``tests/test_e2e_ppo.py`` (the `demo --ppo`
command: reward rises, each critic update lowers the value loss, the critic's checkpoint and export),
which runs under skyrl 0.4; here through 0.3.1's trainer with our critic on its worker contract."""

from test_e2e_ppo import (  # noqa: F401  (pytest collects the imported tests and fixture)
    ppo_run,
    pytestmark,
    test_critic_checkpoint_is_complete_and_its_export_is_the_hosts_critic_layout,
    test_reward_rises_and_the_critics_updates_lower_the_value_loss,
)
