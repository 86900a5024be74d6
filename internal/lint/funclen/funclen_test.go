package funclen_test

import (
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/stagelet/stagelet/internal/lint/funclen"
)

func TestAnalyzer(t *testing.T) {
	analysistest.Run(t, analysistest.TestData(), funclen.Analyzer, "a")
}
