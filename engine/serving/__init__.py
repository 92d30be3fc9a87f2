"""Where the step loop runs (a thread or a child process) behind one EngineClient protocol."""
