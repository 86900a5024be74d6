package main

import (
	"flag"

	"github.com/stagelet/stagelet/config"
)

// nodeFlags are the flags every command that works on a node's state
// shares with serve: where the configuration and the state are.
type nodeFlags struct {
	config, state, run *string
}

func addNodeFlags(fs *flag.FlagSet) nodeFlags {
	return nodeFlags{
		config: fs.String("config", "", "node config YAML (default: the embedded default)"),
		state:  fs.String("state-dir", "", "durable state directory (default: the configuration's, else "+defaultStateDir+")"),
		run:    fs.String("run-dir", "", "volatile state directory (default: the configuration's, else "+defaultRunDir+")"),
	}
}

// resolve loads the configuration and picks the state and run directories
// as serve does.
func (n nodeFlags) resolve() (cfg *config.Config, state, run string, err error) {
	cfg = config.Default()
	if *n.config != "" {
		if cfg, err = config.Load(*n.config); err != nil {
			return nil, "", "", err
		}
	}
	return cfg, pick(*n.state, cfg.StateDir, defaultStateDir), pick(*n.run, cfg.RunDir, defaultRunDir), nil
}

// pick is the flag's value, else the configuration's, else the default.
func pick(flagVal, cfgVal, def string) string {
	switch {
	case flagVal != "":
		return flagVal
	case cfgVal != "":
		return cfgVal
	}
	return def
}
