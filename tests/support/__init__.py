"""What the tests share: the rank pool, fault injection, layouts, the hostile suite, the layout check."""
