"""The Trio engine: request actors, scheduler, executor, dispatcher, sampler, recovery, model manager."""
