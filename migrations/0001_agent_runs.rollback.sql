DROP TABLE agent_runs;
