"""The user-facing codemod run: CLI, configuration, discovery, runner, progress, cache, reports and writes."""
