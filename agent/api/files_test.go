package api

import (
	"io/fs"
	"strings"
	"testing"
)

func TestFileTreeCheck(t *testing.T) {
	dir := FileEntry{Path: ".", Mode: fs.ModeDir | 0o755}
	file := func(p string) FileEntry { return FileEntry{Path: p, Mode: 0o644, Data: []byte("x")} }
	sub := func(p string) FileEntry { return FileEntry{Path: p, Mode: fs.ModeDir | 0o755} }
	link := func(p, to string) FileEntry { return FileEntry{Path: p, Mode: fs.ModeSymlink | 0o777, Link: to} }
	for _, tc := range []struct {
		name    string
		tree    *FileTree
		wantErr string
	}{
		{"atomic writer", &FileTree{Name: "v", Entries: []FileEntry{dir, sub("..2026_11_28"), file("..2026_11_28/key"), link("..data", "..2026_11_28"), link("key", "..data/key")}}, ""},
		{"single file", &FileTree{Name: "v", Entries: []FileEntry{{Path: ".", Mode: 0o644, Data: []byte("hosts")}}}, ""},
		{"link anywhere is fine", &FileTree{Name: "v", Entries: []FileEntry{dir, link("l", "/etc/shadow")}}, ""},
		{"nil", nil, "no file tree"},
		{"bad name", &FileTree{Name: "../x", Entries: []FileEntry{dir}}, "bad volume name"},
		{"dot name", &FileTree{Name: ".x", Entries: []FileEntry{dir}}, "bad volume name"},
		{"empty", &FileTree{Name: "v"}, "entries"},
		{"no root", &FileTree{Name: "v", Entries: []FileEntry{file("a")}}, "not the root"},
		{"file with children", &FileTree{Name: "v", Entries: []FileEntry{{Path: ".", Mode: 0o644}, file("a")}}, "no entries beneath"},
		{"escape", &FileTree{Name: "v", Entries: []FileEntry{dir, file("../x")}}, "bad path"},
		{"escape inside", &FileTree{Name: "v", Entries: []FileEntry{dir, sub("a"), file("a/../../x")}}, "bad path"},
		{"absolute", &FileTree{Name: "v", Entries: []FileEntry{dir, file("/etc/x")}}, "bad path"},
		{"unclean", &FileTree{Name: "v", Entries: []FileEntry{dir, file("a//b")}}, "bad path"},
		{"dot again", &FileTree{Name: "v", Entries: []FileEntry{dir, file(".")}}, "bad path"},
		{"through a link", &FileTree{Name: "v", Entries: []FileEntry{dir, link("a", "/etc"), file("a/passwd")}}, "parent is not a directory"},
		{"under a file", &FileTree{Name: "v", Entries: []FileEntry{dir, file("a"), file("a/b")}}, "parent is not a directory"},
		{"child first", &FileTree{Name: "v", Entries: []FileEntry{dir, file("a/b"), sub("a")}}, "parent is not a directory"},
		{"twice", &FileTree{Name: "v", Entries: []FileEntry{dir, file("a"), file("a")}}, "listed twice"},
		{"device", &FileTree{Name: "v", Entries: []FileEntry{dir, {Path: "d", Mode: fs.ModeDevice}}}, "not a file"},
		{"empty link", &FileTree{Name: "v", Entries: []FileEntry{dir, link("l", "")}}, "bad link"},
		{"too big", &FileTree{Name: "v", Entries: []FileEntry{dir, {Path: "a", Mode: 0o644, Data: make([]byte, MaxFileTreeBytes+1)}}}, "bytes of files"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.tree.Check()
			if tc.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("got %v, want an error with %q", err, tc.wantErr)
			}
		})
	}
}

func TestValidVolumeName(t *testing.T) {
	for name, want := range map[string]bool{"copy-ab12": true, "a.b_c-d": true, "": false, ".": false, "..data": false, "a/b": false, strings.Repeat("a", 129): false} {
		if got := ValidVolumeName(name); got != want {
			t.Errorf("ValidVolumeName(%q) = %v, want %v", name, got, want)
		}
	}
}
