"""Pure helpers every layer (data, models, eval, train) may import: losses, precision, config
parsing, CPU kernels. They import nothing from draftsmith but its error type."""
