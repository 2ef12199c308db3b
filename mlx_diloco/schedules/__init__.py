"""When each worker of a job trains and meets the others, MLX-free: its strategy's sync schedule
(schedule.py: the sync rule), workers of different speeds (speeds.py), and who is a member
when (membership.py)."""
