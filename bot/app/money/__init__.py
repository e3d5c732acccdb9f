"""Money: what use costs and who pays (billing, budgets, rollups, the usage window, the weekly digest and its advice, prices, recommendations, the history replay)."""
