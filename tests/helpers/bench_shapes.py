"""Model shapes shared by benchmarks and the tests that check the planner on them (config.json contents)."""

# bench/two_hosts.py: ZeRO-3 traffic (~20 MB each way per step) large beside pipeline activations (~2 MB)
LLAMA_3M = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 704,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
