"""The RL dataflow on the single controller (PPO family) and the SFT warm-start trainer."""
