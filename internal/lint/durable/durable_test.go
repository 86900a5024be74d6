package durable_test

import (
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/stagelet/stagelet/internal/lint/durable"
)

func TestAnalyzer(t *testing.T) {
	analysistest.Run(t, analysistest.TestData(), durable.Analyzer, "a")
}
