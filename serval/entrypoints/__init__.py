"""The ways in: the `serval` command (cli.py, its flags in cli_options.py), the wiring of a server from its
configs (wiring.py), the terminal tools (terminal_chat.py over chat_client.py, local_server.py for
`--model`), and the offline `LLM` (llm.py, llm_media.py). Nothing below imports this package."""
