"""``omnilearn simulate``: the one simulator package (the what-if tool over modelled workers, and the churn scenario)."""
