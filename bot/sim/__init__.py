"""`gpubot simulate`: the scheduler replayed on a virtual clock; beside the app, over
`bot.domain.scheduling` and `provisioning.simulated`."""
